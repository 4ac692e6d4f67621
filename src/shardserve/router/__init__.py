"""Placing requests on replicas: the policy (prefix indexes of page digests, load), shared with
the standalone HTTP router (gateway/), and the in-server router process for `--dp-size`."""
