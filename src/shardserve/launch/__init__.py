"""Starting, watching and stopping the processes of the rank grid (used by the server and LLM)."""


class LaunchError(RuntimeError):
    """A worker, rank or node failed to start or join; the message names it and says why.
    `exit_code` 2: it failed on a setting the user gave (as a bad flag does), not a fault."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
