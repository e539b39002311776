"""The loss-threshold attack (Yeom, Giacomelli, Fredrikson & Jha, "Privacy Risk in Machine
Learning: Analyzing the Connection to Overfitting", CSF 2018, section 3.2, Adversary 2):
predict "member" iff the loss l(x, y) <= tau. Sweeping tau gives the ROC curve; tau = the
members' mean loss (the expected training loss the adversary is assumed to know) gives the
paper's attack, whose advantage TPR - FPR is bounded by the generalization gap. The label-only
variant ("correct => member", the paper's Adversary 1 for bounded losses) has advantage
train accuracy - test accuracy on the audited sets."""

from __future__ import annotations

from typing import Any

from fedloom.audit.membership import MembershipSet
from fedloom.audit.metrics import attack_summary, rates
from fedloom.audit.outputs import Outputs


def loss_attack(outputs: Outputs, target: MembershipSet) -> dict[str, Any]:
    """The loss-threshold attack on ``target``'s members and non-members, from the model's
    ``outputs`` on ``target.x``."""
    member = target.member
    scores = outputs.true_class_score(target.y)
    result = attack_summary(scores.numpy(), member.numpy())
    tau = float(scores[member].mean())  # -(mean training loss) for logits
    result["threshold_attack"] = {"tau": -tau, **rates((scores >= tau).numpy(), member.numpy())}
    correct = outputs.predictions() == target.y
    result["label_only"] = rates(correct.numpy(), member.numpy())
    result["member_accuracy"] = float(correct[member].double().mean())
    result["nonmember_accuracy"] = float(correct[~member].double().mean())
    result["generalization_gap"] = result["member_accuracy"] - result["nonmember_accuracy"]
    result["member_loss"] = float(outputs.loss(target.y)[member].mean())
    result["nonmember_loss"] = float(outputs.loss(target.y)[~member].mean())
    return result
