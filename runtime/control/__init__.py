"""The control plane: the controller's view of a cluster (the Cluster protocol), its gRPC client, and the in-process cluster."""
