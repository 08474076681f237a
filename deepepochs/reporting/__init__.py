"""What a run shows: the console's progress bars and messages (`console`) and the TensorBoard writers a
run shares (`summary_writer`)."""

__all__: list[str] = []
