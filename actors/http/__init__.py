"""The HTTP application: the native, OpenAI-compatible and documents routes, the playground, guards,
streaming and metrics."""
