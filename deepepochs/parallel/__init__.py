"""Several processes: the one-process and DDP policies (`ddp`), FSDP built on DDP (`fsdp`), which policy
a Trainer holds (`strategy`) and the process group's lifecycle (`process_group`). Starting the processes
is `deepepochs.launch`."""

__all__: list[str] = []
