import pytest

from glassformer.experiments.recall_tasks import (
    Needle,
    frame,
    haystack_prompt,
    needles,
    recalled,
    spells_digits,
)
from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.formats.tokenizers import CharTokenizer, HFTokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def text(corpus):
    return corpus.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def chat(text):
    """A BPE tokenizer with digits and a ChatML template, as SmolLM2's."""
    base = HFTokenizer.train_bpe([text[:20_000], "0123456789 secret number Verona"], 500)
    base.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return ChatTokenizer(base.tokenizer, "<|im_end|>", "<|im_start|>", TEMPLATE)


@pytest.fixture(scope="module")
def chars(text):
    """The character models' vocabulary: Shakespeare's characters (of the digits, only '3')."""
    return CharTokenizer.train([text])


@pytest.mark.parametrize("which", ["chat", "chars"])
@pytest.mark.parametrize("length", [300, 700])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_needle_lies_at_its_depth_in_a_prompt_of_exactly_the_length(request, which, length, depth):
    tokenizer = request.getfixturevalue(which)
    hay = tokenizer.encode(request.getfixturevalue("text"))
    needle = needles(seed=7, count=1, spelled=spells_digits(tokenizer))[0]
    prompt = haystack_prompt(tokenizer, hay, [needle], [depth], length)
    assert len(prompt.ids) == length
    piece = tokenizer.encode(f"\n{needle.sentence}\n")
    start, (begin, end) = prompt.starts[0], prompt.document
    assert prompt.ids[start : start + len(piece)] == piece
    assert start - begin == round(depth * (end - begin - len(piece)))
    # the rest of the document is the haystack from its first token, in order
    assert prompt.ids[begin:start] + prompt.ids[start + len(piece):end] == hay[: end - begin - len(piece)]
    # the frame is the chat template around the user's message, then the answer's start
    document = tokenizer.decode(prompt.ids[begin:end])
    message = f"{document}\n\n{needle.question}"
    expected = (tokenizer.render_chat([{"role": "user", "content": message}]) if which == "chat"
                else f"{message}\nAnswer: ") + needle.answer_start
    assert tokenizer.decode(prompt.ids) == expected


def test_multi_key_hides_every_needle_once_and_asks_for_the_first(chat, text):
    hay = chat.encode(text)
    hidden = needles(seed=3, count=4)
    assert len({n.city for n in hidden}) == 4 and len({n.number for n in hidden}) == 4
    assert needles(seed=3, count=4) == hidden  # seeded
    prompt = haystack_prompt(chat, hay, hidden, [0.8, 0.1, 0.5, 0.9], 900)
    assert len(prompt.ids) == 900 and prompt.asked == hidden[0]
    decoded = chat.decode(prompt.ids)
    assert all(decoded.count(n.sentence) == 1 for n in hidden)
    assert decoded.endswith(f"{hidden[0].question}<|im_end|>\n<|im_start|>assistant\n"
                            f"{hidden[0].answer_start}")
    assert prompt.starts[1] < prompt.starts[2] < prompt.starts[0] < prompt.starts[3]  # by depth


def test_the_frame_has_no_template_without_one(chars):
    head, tail = frame(chars, Needle("Verona", 4821, spelled=True))
    assert head == [] and chars.decode(tail) == (
        "\n\nWhat is the secret number of Verona?\nAnswer: The secret number of Verona is")


def test_numbers_are_spelled_only_where_the_vocabulary_lacks_digits(chat, chars):
    assert not spells_digits(chat) and spells_digits(chars)
    assert Needle("Pisa", 4821, spelled=True).value == "four eight two one"
    assert Needle("Pisa", 4821).sentence == "The secret number of Pisa is 4821."


def test_scoring_is_exact_match_of_the_number():
    needle = Needle("Verona", 4821)
    assert recalled(" 4821.", needle) and recalled("It is 4821, I think", needle)
    assert not recalled(" 482.", needle) and not recalled(" 4812.", needle)
    spelled = Needle("Verona", 4821, spelled=True)
    assert recalled(" four eight two one.", spelled) and not recalled(" four eight two", spelled)


def test_refuses_prompts_that_cannot_hold_the_needles(chat, text):
    hay = chat.encode(text)
    with pytest.raises(ValueError, match="^length: 40 tokens cannot hold"):
        haystack_prompt(chat, hay, needles(1, 4), [0, 0, 0, 0], 40)
    with pytest.raises(ValueError, match="^length: the haystack has 50 tokens"):
        haystack_prompt(chat, hay[:50], needles(1, 1), [0.5], 400)
    with pytest.raises(ValueError, match="^depths: one per needle"):
        haystack_prompt(chat, hay, needles(1, 1), [1.5], 400)
    with pytest.raises(ValueError, match="^count"):
        needles(1, 0)
