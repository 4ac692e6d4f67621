"""The command line: the `shardserve` dispatcher and the flags every command shares.

It sits above server/ and bench/: both are handed what the flags describe, and neither imports
this package.
"""
