"""What crosses between processes: the wire format, the data plane (transport, resharding), credentials."""
