"""Local task files: JSON Lines of `{"context", "question", "answer"}` records, the shape of LongBench-style data.

Each record is scored like a generated example: the prompt is `[BOS] context question`, the answer follows, and the
model reads both in one pass. `answer` may be a string or a list of acceptable strings (LongBench's `answers`); a list
is scored on its first entry, since teacher forcing needs one token sequence. A record's task name is its file's stem,
its length the tokens it really has (rows are padded to a shared size, see forward.Scorer.seq_len_for), its depth -1.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from maxctx.errors import DataError
from maxctx.data.tasks import Example, Pieces

FIELDS = ("context", "question", "answer")


def read(path: str, pieces: Pieces) -> list[Example]:
  p = pathlib.Path(path).expanduser()
  if not p.is_file():
    raise DataError(f"eval task file {path} does not exist; give JSONL files of {{\"context\", \"question\", "
                    "\"answer\"}} records with --files or eval.files.")
  out = []
  with open(p, encoding="utf-8", errors="replace") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"eval task file {path} line {line_no}"
      try:
        record = json.loads(line)
      except ValueError as e:
        raise DataError(f"{where} is not JSON ({e}); fix the line or remove it.") from None
      if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        have = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} needs the fields context, question and answer but has {have}; rename the fields.")
      answer = record["answer"]
      if isinstance(answer, list):
        answer = answer[0] if answer else ""
      if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"{where} has an empty or non-text answer {record['answer']!r}; give the answer as text.")
      prompt = pieces.bos + pieces(str(record["context"])) + pieces(str(record["question"]))
      answer_ids = pieces(answer.strip())
      out.append(Example(task=p.stem, length=len(prompt) + len(answer_ids), depth=-1.0, index=len(out),
                         prompt=np.asarray(prompt, np.int32), answer=np.asarray(answer_ids, np.int32),
                         answer_text=answer.strip(), parts=(answer.strip(),)))
  if not out:
    raise DataError(f"eval task file {path} holds no records; add {{\"context\", \"question\", \"answer\"}} lines.")
  return out
