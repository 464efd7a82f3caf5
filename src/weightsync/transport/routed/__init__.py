"""The routed transport: shm within a node, torch across nodes, per writer/reader pair."""
