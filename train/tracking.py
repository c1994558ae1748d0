"""An offline accelerate tracker: one JSON object per logged step, appended to a file."""
import json
import time
from pathlib import Path

from accelerate.tracking import GeneralTracker, on_main_process


class JSONLinesTracker(GeneralTracker):
    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)

    @property
    def tracker(self):
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict):
        self._append({"config": values})

    @on_main_process
    def log(self, values: dict, step=None, **kwargs):
        self._append({"step": step, "time": round(time.time(), 3), **values})

    def _append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
