"""Starting, watching and stopping the processes of the rank grid (used by the server and LLM)."""
