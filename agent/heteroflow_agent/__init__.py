"""HeteroFlow node agent. A separate package: it never imports the server."""
