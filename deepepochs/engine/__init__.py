"""The engine: run-time context, the spec's guards and actions, the micro-batch loop and the driver."""

__all__: list[str] = []
