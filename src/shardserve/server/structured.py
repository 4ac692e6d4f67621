"""A request's structured-output fields as SamplingParams.structured_outputs, or a 400 naming the field.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}; "text" asks for nothing), SGLang's extension fields `regex` and
`ebnf`, `grammar` (EBNF/GBNF or Lark), vLLM's older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`, and its newer `structured_outputs` object (the fields of
StructuredOutputsParams): at most one per request.
"""

from __future__ import annotations

import re

from shardserve.server.errors import APIError
from shardserve.structured_outputs import StructuredOutputsParams

# Request field -> the StructuredOutputsParams field it sets.
FIELDS = {"regex": "regex", "grammar": "grammar", "ebnf": "grammar", "guided_json": "json",
          "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body) -> StructuredOutputsParams | None:
    asked = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema",
                           param="response_format")
        asked.append(("response_format", {"json": rf.json_schema.schema_}))
    asked += [(name, {kind: getattr(body, name)}) for name, kind in FIELDS.items() if getattr(body, name) is not None]
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs))
    if len(asked) > 1:
        raise APIError(400, f"{asked[0][0]} and {asked[1][0]} cannot be combined: one structured output "
                            f"per request", param=asked[1][0])
    if not asked:
        return None
    name, spec = asked[0]
    try:
        return StructuredOutputsParams(**spec)
    except TypeError:  # a key of `structured_outputs` that is not one of its fields
        raise APIError(400, f"structured_outputs takes {', '.join(StructuredOutputsParams.__dataclass_fields__)}",
                       param=name) from None
    except ValueError as e:
        why = re.sub(r"^SamplingParams\.structured_outputs[.:]\s*", "", str(e))
        raise APIError(400, f"{name}: {why}", param=name) from None
