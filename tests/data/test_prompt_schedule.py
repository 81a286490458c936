"""PromptSchedule over finite sources: each data epoch reads every usable row once in a seeded shuffled
order, a dataset smaller than an iteration wraps into the next epoch, a resumed schedule draws exactly
what the first had not, and overlong or chat rows follow the prompt format."""

from __future__ import annotations

import pytest

from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.prompts.prompt_row import PromptRow

TOKENIZER = build_char_tokenizer()
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


class ListSource:
    """A finite prompt source over texts (the rows of a small dataset)."""

    def __init__(self, texts, answers=None, messages=False):
        self.texts, self.answers, self.messages = texts, answers, messages

    @property
    def num_rows(self):
        return len(self.texts)

    def row(self, index):
        answer = self.answers[index] if self.answers else None
        if self.messages:
            return PromptRow(index=index, messages=[{"role": "user", "content": self.texts[index]}], answer=answer)
        return PromptRow(index=index, prompt=self.texts[index], answer=answer)


def rows_of(schedule, ids):
    return [d.row.index for d in schedule.draw(list(ids), version=0).values()]


def test_each_data_epoch_reads_every_row_once_in_its_own_seeded_order():
    source = ListSource([f"{i}=" for i in range(10)])
    schedule = PromptSchedule(source, TOKENIZER, group_size=2, seed=0)
    epoch0, epoch1 = rows_of(schedule, range(10)), rows_of(schedule, range(10, 20))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))
    assert rows_of(PromptSchedule(source, TOKENIZER, group_size=2, seed=0), range(20)) == epoch0 + epoch1
    assert rows_of(PromptSchedule(source, TOKENIZER, group_size=2, seed=1), range(10)) != epoch0


def test_a_dataset_smaller_than_an_iteration_wraps_without_colliding_ids():
    schedule = PromptSchedule(ListSource(["1=", "2=", "3="]), TOKENIZER, group_size=4, seed=0)
    drawn = schedule.draw(list(range(8)), version=5)  # one iteration of 8 prompts over 3 rows
    assert sorted(drawn) == list(range(8))  # prompt ids stay the draw index: distinct seeds per draw
    assert len({seed for d in drawn.values() for seed in d.request.seeds}) == 32
    rows = [d.row.index for d in drawn.values()]
    assert sorted(rows[:3]) == sorted(rows[3:6]) == [0, 1, 2]


def test_a_resumed_schedule_draws_exactly_the_prompts_not_yet_trained():
    source = ListSource([f"{i}=" for i in range(7)])
    first = PromptSchedule(source, TOKENIZER, group_size=2, seed=3)
    whole = rows_of(first, range(20))
    first.advance(9)  # two iterations of 4 and a partial one... the cursor as the datamodule leaves it
    resumed = PromptSchedule(source, TOKENIZER, group_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert rows_of(resumed, range(resumed.cursor, 20)) == whole[9:]
    other = PromptSchedule(ListSource([f"{i}=" for i in range(8)]), TOKENIZER, group_size=2, seed=3)
    with pytest.raises(ValueError, match="checkpoint's data had 7 usable prompt rows, this run's has 8"):
        other.load_state_dict(first.state_dict())
    other_rows = ListSource([f"{i}=" for i in range(1, 8)])  # same count, other rows
    for changed in (
        PromptSchedule(other_rows, TOKENIZER, group_size=2, seed=3),
        PromptSchedule(source, TOKENIZER, group_size=2, seed=4),  # another seed: another order
    ):
        with pytest.raises(ValueError, match="checkpoint's data had other prompt rows"):
            changed.load_state_dict(first.state_dict())


def test_overlong_prompts_are_refused_or_dropped_by_name():
    source = ListSource(["12=", "1234567=", "3="])
    with pytest.raises(ValueError, match=r"row 1: the prompt has 8 tokens, more than the limit of 4.*overlong=drop"):
        PromptSchedule(source, TOKENIZER, group_size=2, prompt_format=PromptFormat(max_prompt_tokens=4), token_limit=4)
    with pytest.warns(UserWarning, match=r"dropped 1 of 3 prompts longer than 4 tokens \(rows 1\)"):
        schedule = PromptSchedule(
            source, TOKENIZER, group_size=2, prompt_format=PromptFormat(overlong="drop"), token_limit=4
        )
    assert schedule.dropped_rows == [1] and schedule.usable_rows == 2
    assert sorted(rows_of(schedule, range(4))) == [0, 0, 2, 2]
    with pytest.raises(ValueError, match="every one of the 1 prompts is longer"):
        PromptSchedule(
            ListSource(["1234567="]), TOKENIZER, 2, prompt_format=PromptFormat(overlong="drop"), token_limit=4
        )
    assert PromptFormat(max_prompt_tokens=10).token_limit(context=16, max_new_tokens=8) == 8


def test_a_procedural_source_is_checked_when_the_schedule_is_built():
    from lit_parl.tasks import CopyTask

    with pytest.raises(ValueError, match="overlong=drop needs a finite source"):
        PromptSchedule(CopyTask(), TOKENIZER, 2, prompt_format=PromptFormat(overlong="drop"), token_limit=3)
    with pytest.raises(ValueError, match=r"row \d: the prompt has \d tokens, more than the limit of 2"):
        PromptSchedule(CopyTask(), TOKENIZER, 2, token_limit=2)  # 3 to 5 tokens each
    with pytest.raises(ValueError, match="need a chat template"):
        PromptSchedule(CopyTask(), TOKENIZER, 2, prompt_format=PromptFormat(chat=True))


def test_chat_rows_go_through_the_template_and_need_one():
    source = ListSource(["hi", "yo"], messages=True)
    with pytest.raises(ValueError, match=r"need a chat template \(the data has messages\).*has none"):
        PromptSchedule(source, TOKENIZER, group_size=2)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    schedule = PromptSchedule(source, tokenizer, group_size=2, prompt_format=PromptFormat(system_prompt="be brief"))
    drawn = schedule.draw([0, 1], version=0)
    assert sorted(d.text for d in drawn.values()) == ["s:be brief;u:hi;a:", "s:be brief;u:yo;a:"]
    assert all(tokenizer.decode(d.request.prompt_tokens) == d.text for d in drawn.values())
    raw_as_chat = PromptSchedule(
        ListSource(["hi"]), tokenizer, group_size=1, prompt_format=PromptFormat(chat=True, add_generation_prompt=False)
    )
    assert raw_as_chat.draw([0], 0)[0].text == "u:hi;"
    with pytest.raises(ValueError, match="row 0 holds chat messages but the prompt format says chat=false"):
        PromptSchedule(source, tokenizer, group_size=2, prompt_format=PromptFormat(chat=False))
    with pytest.raises(ValueError, match="overlong"):
        PromptFormat(overlong="truncate")


def test_bad_rows_name_themselves():
    for row, message in [
        (dict(prompt="  "), "row 2: the prompt is empty"),
        (dict(messages=[{"role": "user"}]), "row 2: message 0 must be a dict with string 'role' and 'content'"),
        (dict(messages="hello"), "row 2: messages must be a non-empty list"),
        (dict(prompt="x", answer=42), r"row 2: the answer must be a string, got int 42"),
        (dict(), "row 2: give exactly one of a prompt text or chat messages"),
    ]:
        with pytest.raises(ValueError, match=message):
            PromptRow(index=2, **row)
