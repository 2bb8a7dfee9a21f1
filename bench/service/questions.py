"""Questions about documents, in other words than theirs, for `npumoed bench retrieval`: the samples' here, and the
written set's (`written_set`: documents of many kinds and their questions, in bench/retrieval_set).

Each question paraphrases one sentence of its sample, the anchor. The samples are written from one pool
of sentences, so an anchor is usually in two or three samples (the long night-shift log holds most of
them): a document holding the anchor answers the question, and so does a chunk whose sentences hold it.
The night-shift log's own questions ask for its nightly facts, which no other sample has.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

WRITTEN_SET = Path(__file__).parent.parent / "retrieval_set"


@dataclass(frozen=True)
class Question:
    filename: str  # the sample it was written for
    anchor: str  # the sentence of that sample it asks about, word for word
    question: str


QUESTIONS = (
    Question("field-note.txt", "Patience is built into the design: a file is left alone until it has stopped "
             "changing, in case it is still being copied.",
             "Why wait before touching a document that may still be growing while it is transferred?"),
    Question("field-note.txt", "A log written for a tired person at midnight should use short sentences and name "
             "the file it is talking about.",
             "How should status messages be worded for someone reading them half asleep?"),
    Question("field-note.txt", "People trust tools that behave the same way every night, even when they never "
             "look at the logs.",
             "What makes users rely on a program whose records they never read?"),
    Question("field-note.txt", "By late evening the house is quiet, the laptop lid is closed, and the inbox folder "
             "still holds the day's unread reports.",
             "What is the scene at home once the computer is shut, with papers still waiting to be read?"),
    Question("waiting-well.md", "Sometimes a document cannot be read at all, and the most helpful answer is a "
             "short, exact sentence saying why.",
             "What is the kindest response when a file turns out to be unreadable?"),
    Question("waiting-well.md", "The best background helpers are like a good night porter: present, reliable and "
             "almost never seen.",
             "Which hotel employee is an unobtrusive service compared to?"),
    Question("waiting-well.md", "Fairness in a document queue mostly means that a single enormous report cannot "
             "starve twenty short letters.",
             "How do you keep one giant file from holding up lots of small ones?"),
    Question("waiting-well.md", "It is tempting to add priorities, tags and dependencies, yet most personal queues "
             "need nothing more than first come, first served.",
             "Do personal to-do lists really need rankings, labels and ordering rules?"),
    Question("battery-budget.html", "A battery kept above a comfortable threshold ages more slowly than one drained "
             "to the last percent every night.",
             "How can I make my laptop's cell last more years?"),
    Question("battery-budget.html", "Heat is the visible part of wasted work, and a machine that stays cool under "
             "load is usually being used wisely.",
             "What does a hot computer tell you about how well it is used?"),
    Question("battery-budget.html", "A half-written result is worse than none, so every output is written under a "
             "temporary name and renamed when complete.",
             "How are incomplete output files kept from ever being seen?"),
    Question("battery-budget.html", "An overnight window lets heavy work happen while the house is asleep and the "
             "electricity is often cheaper.",
             "Why schedule demanding jobs for the hours when everyone sleeps and power costs less?"),
    Question("paper-archive.pdf", "A scanned page without a text layer is only a picture of words, and extraction "
             "has nothing to read there.",
             "Why can't text be pulled out of an image-only scan?"),
    Question("paper-archive.pdf", "Page numbers are a habit of paper that survives in digital files, long after "
             "anyone has printed them.",
             "Which printing-era convention lingers on in electronic documents?"),
    Question("paper-archive.pdf", "When the queue is empty the worker should sleep deeply rather than ask every "
             "second whether anything has changed.",
             "With nothing left to do, should the process keep polling constantly?"),
    Question("paper-archive.pdf", "Every archive holds documents that were never meant to be kept, and some of them "
             "turn out to be the most revealing.",
             "Which stored papers sometimes end up telling us the most?"),
    Question("expert-committee.docx", "The router is the committee's secretary: it reads each token and decides "
             "which experts should see it.",
             "What component chooses which specialists handle each word?"),
    Question("expert-committee.docx", "Importance is a useful tiebreak: when space runs out, the tokens with the "
             "smallest routing weight are the first to give way.",
             "When an expert is full, which tokens get dropped first?"),
    Question("expert-committee.docx", "A neural accelerator is fastest when it knows in advance the exact shape of "
             "every array it will be asked to multiply.",
             "What does the neural engine need to know ahead of time to run at top speed?"),
    Question("expert-committee.docx", "Memory traffic, not arithmetic, is often what limits a model running on a "
             "small device.",
             "What really holds back inference on a little gadget?"),
    Question("night-shift-log.txt", "At dusk the inbox held 25 documents, the largest of them a 156-page manual.",
             "On which evening was the biggest arrival a handbook running to 156 pages?"),
    Question("night-shift-log.txt", "By 2:14 the queue was empty, with 0 documents set aside for a person to look "
             "at.",
             "On which night had the work run out at 2:14 in the morning?"),
    Question("night-shift-log.txt", "The machine ran on battery at 39 percent and the scheduler started at once.",
             "When did work begin straight away even though the charge was down to 39 percent?"),
    Question("night-shift-log.txt", "At dusk the inbox held 6 documents, the largest of them a 34-page contract.",
             "Which evening brought only six files, the longest an agreement of 34 pages?"),
)


def written_set(folder: Path = WRITTEN_SET) -> tuple[dict[str, str], tuple[Question, ...]]:
    """The written set's texts by file name, and its questions (questions.toml), each anchored in one text."""
    texts = {path.name: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt"))}
    asked = tomllib.loads((folder / "questions.toml").read_text(encoding="utf-8"))["question"]
    return texts, tuple(Question(q["file"], q["anchor"], q["question"]) for q in asked)
