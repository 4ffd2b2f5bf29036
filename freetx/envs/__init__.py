"""Environments and the learners that act in them: Dark Room and tabular Q-learning (for
the AD recipe, plain numpy); language environments for multi-turn RL (language.py: the
protocol; tools.py: tool schemas and calls) and the built-in ones (the calculator, the
guessing game, Dark Room as text). They import nothing of freetx above them."""

from freetx.envs.calculator import Calculator
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
from freetx.envs.guessing import GuessingGame
from freetx.envs.language import (
    BuiltinTask,
    LanguageEnvironment,
    Message,
    ProvidesTools,
    SingleReply,
    Turn,
    last_reply,
)
from freetx.envs.qlearning import HistoryConfig, history_shard, learning_histories
from freetx.envs.text_darkroom import TextDarkRoom

# the built-in language environments by task name (`dataset.tasks: [calculator]`)
BUILTIN_ENVS: dict[str, type] = {c.name: c for c in (Calculator, GuessingGame, TextDarkRoom)}

__all__ = [
    "BUILTIN_ENVS",
    "NUM_ACTIONS",
    "BuiltinTask",
    "Calculator",
    "GuessingGame",
    "LanguageEnvironment",
    "Message",
    "ProvidesTools",
    "SingleReply",
    "TextDarkRoom",
    "Turn",
    "last_reply",
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
