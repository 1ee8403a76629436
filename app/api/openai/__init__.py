"""OpenAI's surface: completions, chat completions, the Responses and Conversations APIs,
their request and response schemas (`schemas.py`, `responses_schemas.py`) and their
framing (`framing.py`, `responses_framing.py`), with tools and structured output
(`structured.py`)."""
