"""Train the oracle: fine-tune a hub checkpoint (--init gpt2-large, the paper's) or train a GPT-2
from a preset's config (offline), on the packed token shards of a prepared run.

    accelerate launch train/finetune_oracle.py --preset paper --data RUN/data --out RUN/oracle
    python train/finetune_oracle.py --preset cpu --data runs/default/data --out runs/default/oracle
    python train/finetune_oracle.py --preset cpu --resume         # continue from the last checkpoint

Multi-GPU and multi-node runs come from `accelerate config` (DDP, FSDP); nothing here changes.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by its path: the repository's folders import

from decode.errors import exits_on_input_error
from train.loop import build_model, language_model_loss, report, start_run, train
from train.presets import ORACLE_PRESETS, TrainArgs, parse_args


@exits_on_input_error
def main(argv=None) -> dict:
    args = parse_args(TrainArgs, ORACLE_PRESETS, __doc__.split("\n\n")[0], argv, prog="python train/finetune_oracle.py")
    run = start_run(args)
    metrics = train(run, build_model(args, run.tokenizer), language_model_loss)
    report(args, metrics)
    return metrics


if __name__ == "__main__":
    main()
