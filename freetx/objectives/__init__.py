"""The objectives of post-training and pretraining: each loss and what it needs, one module
per objective.

    cross_entropy.py  next-token cross-entropy (SFT, pretraining), the router loss of MoE
    logprobs.py       a model's log-probabilities of its labels: per token, sequence, document
    preference.py     DPO and its kin (IPO, robust, hinge, SimPO, ORPO) over pairs
    kto.py            KTO over unpaired examples (desirable or not), with its KL baseline
    advantages.py     advantage estimates of a rollout's completions (group, RLOO, REINFORCE++)
    grpo.py           GRPO and its kin (DAPO, Dr. GRPO, GSPO): the clipped policy-gradient loss
    rollouts.py       prompts -> completions generated, scored, weighted: RL's micro-batches
    distillation.py   a student learning a teacher's distribution (KL, reverse KL, JSD)
    rewards.py        reward functions: what a completion scores
    judge.py          a frozen model's verdict as a reward (LLM-as-judge)
    reward_model.py   reward models: the Bradley-Terry loss, a trained one's score as a reward
    held_model.py     the frozen model a reward runs (a judge's, a reward model's): placed, gathered
    episodes.py       multi-turn episodes with environments and tools (an RL rollout)
    reference.py      the model a loss compares with: adapters off, a frozen copy, precomputed
    precompute.py     per-sample tables a frozen model computes once (reference, teacher)

Configs name them as `freetx.objectives.<Name>` (`loss:`, `rewards:`). Nothing here
imports a recipe; the shared loop mechanics they use are `freetx.training`'s.
"""

from freetx.objectives.advantages import (
    GroupAdvantages,
    GroupMean,
    LeaveOneOut,
    ReinforcePlusPlus,
    TokenAdvantages,
    group_advantages,
)
from freetx.objectives.cross_entropy import CrossEntropyLoss, loss_tokens, with_router_loss
from freetx.objectives.distillation import DistillationLoss, TeacherTokens, TeacherTopK
from freetx.objectives.grpo import GRPOLoss
from freetx.objectives.judge import Judge
from freetx.objectives.kto import KTOBaseline, KTOLoss
from freetx.objectives.logprobs import SequenceLogProbs, sequence_logps, token_logps
from freetx.objectives.preference import PreferenceLoss
from freetx.objectives.reward_model import BradleyTerryLoss, RewardModel
from freetx.objectives.rewards import (
    ExactMatch,
    HoldsModel,
    LengthPenalty,
    RegexFormat,
    Reward,
    RewardError,
    RewardFunction,
    build_rewards,
    score_completions,
)

__all__ = [
    "BradleyTerryLoss",
    "CrossEntropyLoss",
    "DistillationLoss",
    "ExactMatch",
    "GRPOLoss",
    "HoldsModel",
    "GroupAdvantages",
    "GroupMean",
    "Judge",
    "KTOBaseline",
    "KTOLoss",
    "LeaveOneOut",
    "LengthPenalty",
    "PreferenceLoss",
    "RegexFormat",
    "ReinforcePlusPlus",
    "Reward",
    "RewardModel",
    "RewardError",
    "RewardFunction",
    "SequenceLogProbs",
    "TeacherTokens",
    "TeacherTopK",
    "TokenAdvantages",
    "build_rewards",
    "group_advantages",
    "loss_tokens",
    "score_completions",
    "sequence_logps",
    "token_logps",
    "with_router_loss",
]
