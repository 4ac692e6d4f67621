"""Starting, watching and stopping the processes of the rank grid (used by the server and LLM)."""


class LaunchError(RuntimeError):
    """A worker, rank or node failed to start or join; the message names it and says why."""
