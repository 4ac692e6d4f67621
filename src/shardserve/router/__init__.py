"""Routing requests over replicas: the policy (shared), the in-server router process for
`--dp-size`, and the standalone HTTP router (`shardserve router`)."""
