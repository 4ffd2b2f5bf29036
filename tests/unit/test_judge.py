"""A judge as a reward (freetx.objectives.Judge): its verdict is the frozen model's own
probability of "Yes" against "No" (their first tokens after the judge's prompt), as
transformers computes it from the same folder and prompt; batched and left-padded or not;
its `score` mode parses the judge's greedy reply."""

from __future__ import annotations

import pytest
import torch

from freetx.objectives import HoldsModel, Judge
from tests.hf_folders import make_folder, make_tokenizer

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nRight? ({answer})"


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    from freetx.data.corpus import builtin_documents

    folder = make_folder(tmp_path_factory.mktemp("judge") / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    return folder


def test_the_verdict_is_the_judges_own_yes_probability(judge_folder):
    import transformers

    judge = Judge(str(judge_folder), TEMPLATE)
    assert isinstance(judge, HoldsModel)
    judge.place(torch.device("cpu"))
    prompts = ["What is 2+2?", "Name a colour of the sky on a clear day, please."]
    completions = ["4", "blue, mostly"]
    scores = judge(prompts, completions, [[], []], answer=["4", "blue"])

    tok = transformers.AutoTokenizer.from_pretrained(judge_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_folder).eval()
    for prompt, completion, answer, score in zip(prompts, completions, ["4", "blue"], scores):
        text = TEMPLATE.format(prompt=prompt, completion=completion, answer=answer)
        chat = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(rendered, add_special_tokens=False)
        # each verdict's token where the reply starts: tokenized after the prompt
        after = [tok.encode(rendered + v, add_special_tokens=False) for v in ("Yes", "No")]
        yes, no = (a[len(ids)] for a in after)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        direct = torch.softmax(logits[[yes, no]].float(), dim=-1)[0].item()
        assert abs(score - direct) < 1e-4, (score, direct)
    one_by_one = [
        judge([p], [c], [[]], answer=[a])[0] for p, c, a in zip(prompts, completions, ["4", "blue"])
    ]
    assert one_by_one == pytest.approx(scores, abs=1e-5)  # the left padding changes nothing


def test_a_judge_that_replies_a_number_and_one_that_is_misconfigured(judge_folder):
    judge = Judge(str(judge_folder), "Rate: {completion}", mode="score", max_new_tokens=4)
    judge.place(torch.device("cpu"))
    scores = judge(["q", "q"], ["a", "b"], [[], []])
    assert all(s is None or isinstance(s, float) for s in scores)
    with pytest.raises(ValueError, match="no \\{completion\\}"):
        Judge(str(judge_folder), "Rate: {prompt}")
    with pytest.raises(ValueError, match="give two verdicts"):
        Judge(str(judge_folder), TEMPLATE, verdicts=["Yes", "Yes"])
    with pytest.raises(RuntimeError, match="was not placed"):
        Judge(str(judge_folder), TEMPLATE)(["q"], ["a"], [[]], answer=["a"])


def test_a_sharded_judge_scores_only_while_gathered(judge_folder):
    """A call a deadline or a stop signal abandoned, running on after the rollout left
    `gathered()`, stops before its forward (which would gather a sharded judge's blocks on
    its rank alone)."""
    judge = Judge(str(judge_folder), TEMPLATE)
    judge.place(torch.device("cpu"))
    judge.sharded = True  # as placed with a sharded policy's plan (tests/distributed)
    with judge.gathered():
        assert len(judge(["Q?"], ["4"], [[]], answer=["4"])) == 1
    with pytest.raises(RuntimeError, match="scored outside its gathered"):
        judge(["Q?"], ["4"], [[]], answer=["4"])
