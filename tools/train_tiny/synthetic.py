"""Synthetic chat turns with reasoning and tool calls, built from templates and lines of the training plays.

They teach the embedded model the shape of a thinking turn (`<think>` with a short sentence, then the answer)
and of a Qwen3.5 tool call, so both can be shown offline. Each conversation is one of:

- plain: a user question in period diction; the assistant thinks, then answers with a line of the plays;
- tool: the system prompt offers one or two tools; the user asks for something one of them does; the assistant
  thinks and calls it; a tool turn answers; the assistant thinks again and gives the final answer;
- declined: tools are offered but the question needs none, so the assistant answers directly.

The reasoning is a line drawn from the plays, not an argument: the model is too small to reason, and the point
is the format. Everything is drawn from one `random.Random(seed)`, so a seed gives the same conversations.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from data import Play, speeches

KINDS = (("plain", 0.5), ("tool", 0.4), ("declined", 0.1))

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "function", "function": {
        "name": "get_weather", "description": "Tell the weather over a town.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "the town"}},
                       "required": ["location"]}}},
    "find_line": {"type": "function", "function": {
        "name": "find_line", "description": "Find a line of the plays that holds a word.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
    "send_letter": {"type": "function", "function": {
        "name": "send_letter", "description": "Send a letter by a messenger.",
        "parameters": {"type": "object", "properties": {"recipient": {"type": "string"}, "message": {"type": "string"}},
                       "required": ["recipient", "message"]}}},
    "muster_soldiers": {"type": "function", "function": {
        "name": "muster_soldiers", "description": "Muster soldiers at a place.",
        "parameters": {"type": "object", "properties": {"place": {"type": "string"}, "count": {"type": "integer"}},
                       "required": ["place", "count"]}}},
}

# Towns of the plays, leaving out the held-out plays' settings (Scotland, Ephesus).
PLACES = ("Verona", "Venice", "Padua", "Mantua", "Milan", "Athens", "Rome", "Elsinore", "Windsor", "London",
          "Navarre", "Messina", "Bohemia", "Illyria", "Cyprus", "Dover", "Harfleur", "Bordeaux", "Orleans", "York",
          "Coventry", "Belmont", "Sicilia", "Troy", "Antium", "Alexandria", "Tyre", "Pentapolis", "Bristol", "Calais")
WEATHER = ("fair and calm", "foul, with rain and wind", "thunder and lightning", "cold, with a hard frost",
           "misty at dawn, then clear", "hot, the sun high", "grey, and the wind in the east", "snow upon the hills")
TOPICS = ("love", "honour", "war", "death", "fortune", "music", "sleep", "friendship", "the king", "the sea",
          "this night", "my father", "the crown", "a woman's heart", "the stars")
ADDRESSES = ("sir", "my lord", "madam", "good friend", "my liege", "gentle cousin", "kind master")
SYSTEMS = ("Thou art a herald of the court.", "Thou art a faithful servant; be brief.",
           "Thou art the king's secretary.", "")

PLAIN_QUESTIONS = ("What say you of {topic}, {addr}?", "Tell me, {addr}, what think you of {topic}?",
                   "How fares {person} today?", "Where is {person}, {addr}?", "Pray, what news of {topic}?",
                   "Speak, {addr}: is there comfort in {topic}?")
ASKS = {
    "get_weather": ("What weather shall we have in {place} tomorrow?", "Pray tell me, how stands the sky o'er {place}?",
                    "Is it fair or foul in {place} today, {addr}?"),
    "find_line": ("Find me a line that speaks of {word}.", "Where is it written of {word}? Show me the line.",
                  "I would hear a verse with the word {word} in it."),
    "send_letter": ("Send word to {person}: {message}", "Bid a messenger tell {person} this: {message}",
                    "Write to {person}, {addr}, and say: {message}"),
    "muster_soldiers": ("Muster {count} soldiers at {place}.", "We need {count} men at {place} by morning.",
                        "Let {count} of our soldiers gather at {place}, {addr}."),
}
ANSWERS = {
    "get_weather": ("The sky o'er {place} is {weather}, {addr}.", "In {place} 'tis {weather}; take thy cloak."),
    "find_line": ("Thus it is written: {line}", "Here is the line, {addr}: {line}"),
    "send_letter": ("It is done; {person} shall have thy letter ere night.", "The messenger is gone to {person}."),
    "muster_soldiers": ("{count} men are mustered at {place}, {addr}.", "{count} soldiers stand ready at {place}."),
}

_SPEAKER = re.compile(r"^([A-Z][A-Z']{2,15})\.$")
_CAPITALS = re.compile(r"[A-Z]{2,}")   # a speaker tag or a stage direction inside a line
ROLES = frozenset("""ACT SCENE ALL BOTH KING QUEEN PRINCE PRINCESS DUKE DUCHESS LORD LADY SERVANT MESSENGER CLOWN FOOL
    PAGE SOLDIER SOLDIERS CITIZEN OFFICER GENTLEMAN GENTLEWOMAN CAPTAIN SENATOR WATCH BOY GHOST PORTER PROLOGUE
    CHORUS EPILOGUE MUSICIAN ATTENDANT OTHERS HERALD KEEPER MAYOR NURSE SHEPHERD SAILOR MASTER POET PAINTER
    SHERIFF GAOLER JAILER SERGEANT TRIBUNE TRIBUNES CARDINAL BISHOP ABBOT FRIAR PRIEST DOCTOR CONSTABLE HOST
    HOSTESS OUTLAW HUNTSMAN FORESTER GARDENER GOVERNOR GENERAL LIEUTENANT PROVOST MARINER MERCHANT""".split())
_WORD = re.compile(r"\b[a-z]{5,12}\b")


@dataclass(frozen=True)
class SyntheticChat:
    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PlayLines:
    """What the templates draw from the plays: short whole lines and speaker names."""

    lines: tuple[str, ...]
    names: tuple[str, ...]

    @cached_property
    def worded(self) -> tuple[str, ...]:
        """Lines with a lower-case word of 5 to 12 letters, for `find_line`."""
        return tuple(line for line in self.lines if _WORD.search(line))


def play_lines(plays: Sequence[Play]) -> PlayLines:
    """Spoken lines that read as one short sentence (3 to 12 words, ending in . ! or ?) and characters' names
    (one-word speaker tags, like ROMEO, that the dialogue also uses as a name, roles like KING left out)."""
    lines, names = set(), set()
    for play in plays:
        for scene in speeches(play):
            for speech in scene:
                for line in speech.split("\n"):
                    words = line.split()
                    if 3 <= len(words) <= 12 and line[:1].isupper() and line.endswith((".", "!", "?")) \
                            and not any(c in line for c in "[]_:;") and not _CAPITALS.search(line):
                        lines.add(line)
        spoken = set(re.findall(r"\b[A-Z][a-z]+\b", play.text))
        for block in play.text.split("\n\n"):
            m = _SPEAKER.match(block.strip().split("\n")[0])
            if m and m.group(1).title() in spoken and m.group(1) not in ROLES:
                names.add(m.group(1).title())
    if not any(_WORD.search(line) for line in lines) or not names:
        raise ValueError("the plays gave no short lines or no speaker names")
    return PlayLines(tuple(sorted(lines)), tuple(sorted(names)))


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_task(rng: random.Random, pool: PlayLines, name: str, addr: str) -> tuple[str, dict[str, Any], str, str]:
    """(question, arguments, tool response, final answer) for one call of `name`."""
    person, place = rng.choice(pool.names), rng.choice(PLACES)
    fill = {"addr": addr, "person": person, "place": place}
    if name == "get_weather":
        weather = rng.choice(WEATHER)
        args, response = {"location": place}, f"{place}: {weather}."
        fill["weather"] = weather
    elif name == "find_line":
        line = rng.choice(pool.worded)
        word = rng.choice(_WORD.findall(line))
        args, response = {"word": word}, line
        fill.update(word=word, line=line)
    elif name == "send_letter":
        message = rng.choice(pool.lines)
        args, response = {"recipient": person, "message": message}, f"The letter to {person} is sent."
        fill["message"] = message
    else:
        count = rng.choice((10, 20, 50, 100, 200, 300, 500, 1000, 2000)) * rng.choice((1, 1, 2, 3))
        args, response = {"place": place, "count": count}, f"{count} soldiers stand at {place}."
        fill["count"] = str(count)
    return rng.choice(ASKS[name]).format(**fill), args, response, rng.choice(ANSWERS[name]).format(**fill)


def _plain_question(rng: random.Random, pool: PlayLines, addr: str) -> str:
    return rng.choice(PLAIN_QUESTIONS).format(topic=rng.choice(TOPICS), addr=addr, person=rng.choice(pool.names))


def _speech(rng: random.Random, pool: PlayLines) -> str:
    """An answer of a few lines: with one-line answers the model learned to end every chat reply at once."""
    return "\n".join(rng.sample(pool.lines, rng.randint(3, 5)))


def conversation(rng: random.Random, pool: PlayLines) -> SyntheticChat:
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    addr = rng.choice(ADDRESSES)
    if kind == "plain":
        return SyntheticChat(kind, [
            {"role": "user", "content": _plain_question(rng, pool, addr)},
            {"role": "assistant", "reasoning_content": rng.choice(pool.lines), "content": _speech(rng, pool)}])
    names = sorted(TOOLS)
    needed = rng.choice(names)
    offered = [needed, *rng.sample([n for n in names if n != needed], rng.randint(0, 1))]
    rng.shuffle(offered)
    tools = [copy.deepcopy(TOOLS[n]) for n in offered]
    system = rng.choice(SYSTEMS)
    head = [{"role": "system", "content": system}] if system else []
    if kind == "declined":
        return SyntheticChat(kind, [
            *head, {"role": "user", "content": _plain_question(rng, pool, addr)},
            {"role": "assistant", "reasoning_content": rng.choice(pool.lines), "content": _speech(rng, pool)}],
            tools)
    question, args, response, answer = _tool_task(rng, pool, needed, addr)
    return SyntheticChat(kind, [
        *head, {"role": "user", "content": question},
        {"role": "assistant", "reasoning_content": rng.choice(pool.lines), "content": "",
         "tool_calls": [_call(needed, args)]},
        {"role": "tool", "content": response},
        {"role": "assistant", "reasoning_content": rng.choice(pool.lines), "content": answer}], tools)


def synthetic_chats(plays: Sequence[Play], count: int, seed: int) -> list[SyntheticChat]:
    """`count` conversations drawn from the plays' lines; the same plays, count and seed give the same list."""
    pool = play_lines(plays)
    rng = random.Random(seed)
    return [conversation(rng, pool) for _ in range(count)]


def held_out_prompt(chat: SyntheticChat) -> dict[str, Any]:
    """The conversation up to its first assistant turn, with the call that turn makes (None when it answers):
    a prompt for checking the trained model, drawn with a seed the training stream does not use."""
    first = next(i for i, m in enumerate(chat.messages) if m["role"] == "assistant")
    calls = chat.messages[first].get("tool_calls") or [None]
    return {"kind": chat.kind, "messages": chat.messages[:first], "tools": chat.tools,
            "expected_call": calls[0] and calls[0]["function"]}
