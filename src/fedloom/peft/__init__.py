"""Parameter-efficient federated fine-tuning of a frozen pretrained transformer (docs/peft.md):
LoRA with every sharing strategy (FedSA, FedIT, FFA, FLoRA, FedEx, HetLoRA), Houlsby adapters,
prompt tuning with the spherical mean. The models live in fedloom.models.transformer; this
package holds the server-side strategy math (``strategies``), the strategy as one piece any
algorithm composes (``sharing``), the strategy-aware partial-sharing algorithms (FedAvg,
FedPer, FedRep: ``algorithm``) and two-model ones (Ditto, APFL, pFedMe: ``personal``), the
wiring from the config (``build``) and peft-library interchange (``interop``)."""

from fedloom.peft.build import (
    build_peft_algorithm,
    build_peft_model,
    build_run_model,
    make_algorithm,
    peft_spec,
)

__all__ = [
    "build_peft_algorithm",
    "build_peft_model",
    "build_run_model",
    "make_algorithm",
    "peft_spec",
]
