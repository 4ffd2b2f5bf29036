"""Environments and the learners that act in them (for recipes that distill or evaluate
agents): Dark Room and tabular Q-learning. Plain numpy; they import nothing of freetx
above them."""

from freetx.envs.darkroom import (
    NUM_ACTIONS,
    DarkRoom,
    DarkRoomConfig,
    GoalSplit,
    goal_split,
    optimal_return,
    random_return,
    state_index,
)
from freetx.envs.qlearning import HistoryConfig, history_shard, learning_histories

__all__ = [
    "NUM_ACTIONS",
    "DarkRoom",
    "DarkRoomConfig",
    "GoalSplit",
    "HistoryConfig",
    "goal_split",
    "history_shard",
    "learning_histories",
    "optimal_return",
    "random_return",
    "state_index",
]
