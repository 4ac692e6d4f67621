import sys

from shardserve.server.cli import main

sys.exit(main())
