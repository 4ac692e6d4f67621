"""`python -m shardserve.launch.worker NAME`: the command every child process runs.

The launcher pickles `(function, args)` to the child's standard input; the child unpickles and
calls it. A child is a fresh interpreter started as a command, so it never re-imports the
launcher's `__main__` (a user's script runs `LLM(tp_size=2)` at top level without a main guard),
and functions travel by name (module + qualified name), never as code.
"""

from __future__ import annotations

import os
import pickle
import sys

PARENT_ENV = "SHARDSERVE_PARENT_PID"


def main() -> None:
    expected_parent = int(os.environ.pop(PARENT_ENV, "0"))
    from shardserve.ipc.sockets import die_with_parent

    die_with_parent()
    if expected_parent and os.getppid() != expected_parent:
        sys.exit(f"{sys.argv[1:]}: the launcher (pid {expected_parent}) died before this process started")
    target, args = pickle.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    target(*args)


if __name__ == "__main__":
    main()
