"""Saved models read with a one-line error: a missing, truncated or garbage checkpoint says which and
what to do, instead of a traceback from deep inside transformers or safetensors."""
from pathlib import Path

from data.errors import InputError, first_line

RETRAIN = "pass a directory written by save_pretrained, or train it again if its files are damaged"


def load_causal_lm(name_or_dir, role: str, hint: str = RETRAIN, **kwargs):
    """AutoModelForCausalLM.from_pretrained(name_or_dir, **kwargs); `role` names it in the error."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(name_or_dir), **kwargs)
    except Exception as err:  # hub, file, JSON and safetensors errors of many kinds
        raise InputError(f"cannot load the {role} from {name_or_dir} ({first_line(err)}); {hint}") from None


def load_safetensors(model_dir) -> dict:
    """Every tensor of the *.safetensors files in a save_pretrained directory."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"no .safetensors weights in {model_dir}; save the model with save_pretrained")
    weights = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except Exception as err:  # SafetensorError, OSError
            raise InputError(f"cannot read the weights {f} ({first_line(err)}); {RETRAIN}") from None
    return weights
