"""Load a checkpoint written by a multi-GPU run into a single-process Trainer, test it and keep training.

    python tests/single_gpu_checkpoint.py \
        --checkpoint /tmp/deepepochs-evaluation-4-fp16/checkpoints/multiple/checkpoint-2.ckpt \
        --source-world-size 4 --precision fp16 --device cuda:0 --output /tmp/deepepochs-single-checkpoint

The checkpoint comes from `tests/multigpu_evaluation.py`, whose model, data and reference this script
imports (the script's folder is on `sys.path` when it runs). Checks:

- the file is a plain `torch.save` dict that records the source world size and 2 completed epochs;
- `trainer.load_checkpoint(path)` puts exactly the file's weights into the model (no DDP `module.`
  prefixes), and under fp16 the GradScaler's scale;
- a renamed copy in another folder loads to the same weights (checkpoints can be moved);
- `test()` gives the same metrics as a recomputation from the file's weights;
- training continues at epoch 3 up to the epoch target and changes the weights.

`--device cpu` works with a CPU-written checkpoint. A CUDA device without CUDA prints
"skipped: CUDA not available", writes a skipped result and exits 0. Writes `<output>/result.json`; the
exit status is 1 when any check fails.
"""

import json
import shutil
import sys
from pathlib import Path

import script_common
import torch
from multigpu_evaluation import BATCH, TOLERANCE, accuracy, make_data, make_model, reference_metrics
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import Trainer


def parse_args():
    return script_common.parse_args("single_gpu_checkpoint", __doc__, {
        "--checkpoint": {"required": True, "help": "a .ckpt file written by multigpu_evaluation.py"},
        "--source-world-size": {"type": int, "default": None, "help": "processes that wrote it"},
        "--device": {"default": "cuda:0"},
        "--output": {"required": True, "help": "folder for result.json and the moved copy"},
    })


def new_trainer(args, epochs: int) -> Trainer:
    model = make_model()
    return Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                   device=args.device, precision=args.precision, metrics=[accuracy], log_batch=False,
                   show_info=False)


def weights(trainer: Trainer) -> dict:
    return {k: v.detach().cpu().clone() for k, v in trainer.raw_model.state_dict().items()}


def main() -> int:
    args = parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: CUDA not available")
        (output / "result.json").write_text(json.dumps({"status": "skipped", "reason": "CUDA not available"}))
        return 0
    source = Path(args.checkpoint)
    stored = torch.load(source, map_location="cpu", weights_only=True)  # readable without deepepochs
    checks = {
        "plain_torch_dict": isinstance(stored, dict) and "model" in stored,
        "records_source_world_size": args.source_world_size in (None, stored.get("world_size")),
        "records_two_epochs": stored.get("epoch") == 2,
    }
    test_ds = make_data(7 * (stored.get("world_size") or 1) + 3, 3)

    trainer = new_trainer(args, epochs=3)
    try:
        trainer.load_checkpoint(source)
        loaded = weights(trainer)
        checks["weights_equal_file"] = loaded.keys() == stored["model"].keys() and all(
            torch.equal(loaded[k], stored["model"][k].cpu()) for k in loaded)
        if args.precision == "fp16":
            scale = (stored.get("scaler") or {}).get("scale")
            checks["grad_scale_restored"] = scale is not None and float(trainer.scaler.get_scale()) == float(scale)
        test = trainer.test(DataLoader(test_ds, batch_size=BATCH))
        reference = reference_metrics(trainer.raw_model, test_ds, trainer.device, args.precision)
        checks["test_matches_reference"] = all(
            abs(test[name] - reference[name]) <= TOLERANCE[args.precision] for name in ("loss", "accuracy"))
        records = trainer.fit(DataLoader(make_data(64, 1), batch_size=BATCH, shuffle=True),
                              DataLoader(make_data(21, 2), batch_size=BATCH))
        checks["continues_at_epoch_3"] = len(records["train"]["loss"]) == 3 and trainer.loop.completed_epochs == 3
        checks["training_changes_weights"] = any(not torch.equal(loaded[k], v) for k, v in weights(trainer).items())
    finally:
        trainer.close()

    moved = output / "moved" / "renamed.ckpt"
    moved.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, moved)
    trainer = new_trainer(args, epochs=3)
    try:
        trainer.load_checkpoint(moved)
        moved_weights = weights(trainer)
        checks["moved_copy_loads_the_same_weights"] = all(torch.equal(loaded[k], v) for k, v in moved_weights.items())
    finally:
        trainer.close()

    passed = all(checks.values())
    result = {"status": "passed" if passed else "failed", "checkpoint": str(source), "device": args.device,
              "precision": args.precision, "source_world_size": stored.get("world_size"), "checks": checks,
              "test": test, "reference": reference}
    (output / "result.json").write_text(json.dumps(result, indent=2))
    print(f"single_gpu_checkpoint: {result['status']}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
