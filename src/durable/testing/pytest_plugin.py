"""pytest fixtures that start real storage servers on 127.0.0.1 (see durable.testing.servers)."""
