"""A model directory's config.json as the lean engines read it: the sizes each model type they run gives, checked
before any of them is used."""
import json
from pathlib import Path

from decode.errors import InputError
from decode.models.pretrained import RETRAIN


def read_config(model_dir, tokens: int | None = None) -> dict:
    """A model directory's config.json; its vocabulary the first `tokens` rows where given (a config that pads the
    tokenizer's: loading.token_rows)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir} is not a model directory (no config.json); pass a directory written by save_pretrained")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path} is not a valid JSON config ({err}); {RETRAIN}") from None
    if not isinstance(config, dict):
        raise InputError(f"{path} is not a model config (a JSON object); {RETRAIN}")
    check_shape_fields(config, path)
    return config if tokens is None else config | {"vocab_size": min(tokens, config["vocab_size"])}


# The sizes the lean engines read from a config of each model_type they run (save_pretrained writes them all), and
# those they read where present
LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SHAPE_FIELDS = {"gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
                "llama": LLAMA_FIELDS, "qwen2": LLAMA_FIELDS, "mistral": LLAMA_FIELDS}
OPTIONAL_SHAPE_FIELDS = ("n_inner", "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")


def check_shape_fields(config: dict, path: Path) -> None:
    """InputError naming the first size a lean engine reads that the config lacks or gives as anything but a positive
    integer, or heads that do not divide what they split; other model types are transformers' to check."""
    needed = SHAPE_FIELDS.get(str(config.get("model_type")))
    if needed is None:
        return
    for name in needed + tuple(f for f in OPTIONAL_SHAPE_FIELDS if config.get(f) is not None):
        value = config.get(name)
        if type(value) is not int or value < 1:
            got = "is missing" if name not in config else f"is {json.dumps(value)[:40]}"
            raise InputError(f"{path}: {name} {got}, where a {config['model_type']} config gives a positive integer; "
                             f"{RETRAIN}")
    if config["model_type"] == "gpt2":
        pairs = [("n_embd", "n_head")]
    else:
        pairs = [("hidden_size", "num_attention_heads")]  # (transformers' own check, a head_dim given or not)
        pairs += [("num_attention_heads", "num_key_value_heads")] * (config.get("num_key_value_heads") is not None)
    for whole, parts in pairs:
        if config[whole] % config[parts]:
            raise InputError(f"{path}: {whole} {config[whole]} is not a multiple of {parts} {config[parts]}; {RETRAIN}")
