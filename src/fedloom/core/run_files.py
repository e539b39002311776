"""The JSON files of a run directory as typed records: serving/serving.json, EXPORT/card.json
and summary.json. A run directory may come from anyone (README.md, "Exit status"): each file
is checked against its model before any of it is used, and a value of the wrong type is a
``RunDirError`` naming the file and the key (exit status 2), never a ``TypeError`` halfway
through an export.

The models check what fedloom's readers use; a key a reader never looks at may hold anything
(summary.json grows a key per mechanism and run family), a key it uses must have its type.
A missing key of summary.json is allowed (an older run, another family); serving.json and
card.json are fedloom's own and must be whole."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from fedloom.core.files import read_json_object
from fedloom.core.settings import StrictModel
from fedloom.errors import RunDirError, clipped

Count = Annotated[int, Field(ge=0)]
Size = Annotated[int, Field(ge=1)]
Name = Annotated[str, Field(min_length=1)]
Metric = float | None
"""A measured number; null where it was not finite (core/files.py, ``finite_json``)."""
Metrics = dict[str, Metric]
Shape = Annotated[list[Size], Field(min_length=1)]


class _Open(StrictModel):
    """A record whose other keys are allowed (and left unchecked)."""

    model_config = ConfigDict(extra="allow")


# -- summary.json's serving section, also in serving.json ------------------------------------
class EmaFacts(_Open):
    decay: float | None = None
    steps: Count | None = None
    test: Metrics | None = None


class BestFacts(_Open):
    round: Count | None = None
    validation: Metric = None
    test: Metrics | None = None


class ClientsBestFacts(_Open):
    rounds: dict[str, Count] | None = None
    test: Metrics | None = None


class ServedFacts(_Open):
    """What a run measured of its served copies (engine/serving.py, ``summary``)."""

    metric: str | None = None
    ema: EmaFacts | None = None
    best: BestFacts | None = None
    clients_best: ClientsBestFacts | None = None
    routing: dict[str, Any] | None = None


# -- summary.json -----------------------------------------------------------------------------
FinalMetrics = dict[str, float | dict[str, Any] | list[Any] | None]
"""A section of ``final``: numbers (a run family may nest its own, RL's returns); never a
string or a bool."""


class Final(_Open):
    """``final``: the last evaluation (the report's, the comparison's and the card's numbers)."""

    global_: FinalMetrics | None = Field(None, alias="global")
    personalized: FinalMetrics | None = None
    client_accuracy: Metrics | None = None


class Communication(_Open):
    bytes_up: float | None = None
    bytes_down: float | None = None
    bytes_up_per_round: float | None = None
    bytes_down_per_round: float | None = None


class Summary(_Open):
    """summary.json (engine/shell.py, ``base_summary``, and what the mechanisms add)."""

    algorithm: Name | None = None
    dataset: Name | None = None
    num_clients: Count | None = None
    rounds: Count | None = None
    seed: int | None = None
    executor: str | None = None
    final: Final | None = None
    communication: Communication | None = None
    wall_seconds: float | None = None
    seconds_per_round: float | None = None
    serving: ServedFacts | None = None


# -- serving/serving.json ---------------------------------------------------------------------
class ServingFiles(StrictModel):
    """``files``: the kept copies, each a file name inside RUN/serving (a copy not kept is
    absent, never null)."""

    global_: Name | None = Field(None, alias="global")
    ema: Name | None = None
    best: Name | None = None
    clients: Name | None = None
    clients_best: Name | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("a file name, not null")
        return value


class ServingMeta(StrictModel):
    """serving/serving.json (engine/serving.py, ``ServingCallback.write``)."""

    format: Literal["fedloom-serving"]
    version: Literal[1]
    task: Literal["classification", "regression"]
    input_shape: Shape
    num_outputs: Size
    model: Name
    param_keys: list[str]
    buffer_keys: list[str]
    rounds: Count
    files: ServingFiles
    clients: list[Count]
    personal: list[Count]
    serving: ServedFacts | None = None


# -- EXPORT/card.json -------------------------------------------------------------------------
class CardModel(StrictModel):
    name: Name
    config: dict[str, Any] | None = None


class CardCopy(_Open):
    """One exported copy: its file (``file``), or one file per client (``files``)."""

    what: str
    file: Name | None = None
    files: dict[str, Name] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> CardCopy:
        if (self.file is None) == (self.files is None):
            raise ValueError("a copy has either file or files")
        return self


class Card(StrictModel):
    """EXPORT/card.json (serving/export.py)."""

    format: Literal["fedloom-export"]
    version: Literal[1]
    model: CardModel
    task: Literal["classification", "regression"]
    input_shape: Shape
    num_outputs: Size
    classes: list[int] | None = None
    dataset: str | None = None
    algorithm: str | None = None
    rounds: Count
    seed: int | None = None
    source: str
    copies: dict[str, CardCopy]
    clients_on_global: list[Count]
    routing: dict[str, Any] | None = None
    load: str


def key_of(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the file's dotted key (``files.global``)."""
    return ".".join(str(p) for p in loc) or "(the whole file)"


def type_problem(value: Any, model: type[StrictModel]) -> str | None:
    """What is wrong with ``value`` as a ``model`` (the first wrong key), or None."""
    try:
        model.model_validate(value)
    except ValidationError as err:
        first = err.errors()[0]
        key = key_of(first["loc"])
        if first["type"] == "missing":
            return f"missing {key}"
        return f"{key}: {first['msg']} (it holds {clipped(repr(first['input']))})"
    return None


def check_typed(value: Any, model: type[StrictModel], path: Path | str) -> None:
    """``RunDirError`` naming ``path`` and the first wrong key unless ``value`` fits ``model``."""
    problem = type_problem(value, model)
    if problem is not None:
        raise RunDirError(
            f"{path}: {problem}; the file is damaged or was not written by fedloom: restore "
            "it, or run again"
        )


def read_typed(path: Path, model: type[StrictModel]) -> dict[str, Any]:
    """The JSON object in ``path``, checked against ``model`` (``check_typed``)."""
    value = read_json_object(path)
    check_typed(value, model, path)
    return value


# -- checkpoints/round_NNNNNN.json (engine/checkpoint.py) -------------------------------------
class TensorRecord(StrictModel):
    """One tensor of the tensor file as the manifest recorded it."""

    dtype: Name
    shape: list[Count]


class TensorFile(StrictModel):
    file: Name
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Count
    layout: dict[str, TensorRecord] | None = None
    """Each tensor's dtype and shape (absent in manifests written before it was recorded)."""


class CheckpointManifest(StrictModel):
    format: Literal["fedloom-checkpoint"]
    version: Literal[1]
    tensors: TensorFile
    tree: Any
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    config_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
