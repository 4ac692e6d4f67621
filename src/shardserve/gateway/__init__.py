"""The standalone HTTP router (`shardserve router`): OpenAI requests forwarded to worker servers,
plain or in front of prefill and decode instances. It places requests with router/'s policy,
the one the in-server router for `--dp-size` uses, and imports nothing of server/."""
