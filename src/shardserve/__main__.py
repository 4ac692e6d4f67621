import sys

from shardserve.cli.main import main

sys.exit(main())
