"""Several processes: the one-process and DDP policies (`ddp`), FSDP built on DDP (`fsdp`) and which policy
a Trainer holds (`strategy`). Starting the processes is `deepepochs.launch`."""

__all__: list[str] = []
