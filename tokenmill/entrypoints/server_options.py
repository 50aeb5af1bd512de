"""ServerOptions: everything `tokenmill serve` takes on top of the engine's options.

One frozen dataclass; each field's metadata `help` is what `tokenmill serve --help` prints (the
flags are generated from the fields by `cli.add_options`). Kept free of FastAPI and the engine, so
that the command line is built without loading them.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from tokenmill.config import option
from tokenmill.entrypoints.reasoning import REASONING_PARSERS
from tokenmill.entrypoints.tool_parsers import DEFAULT_TOOL_PARSER, tool_parser_names
from tokenmill.sampling_params import MAX_N

API_KEY_ENV = "TOKENMILL_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MIB = 1024 * 1024
# Tokenizer processes: each is a Python process with its own tokenizer and sockets; far past a
# host's cores they only cost memory (a million hung the start in ZMQ errors).
MAX_TOKENIZER_WORKERS = 256
# The longest Retry-After a 503 may ask for (an hour: a client told to wait days never returns).
MAX_RETRY_AFTER_S = 3600


@dataclass(frozen=True)
class ServerOptions:
    """HTTP server options: where to listen, who may call, and how much one request may ask."""

    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(8000, "Port to listen on (checked before the model loads).")
    served_model_name: str | None = option(
        None, "Model name clients use (default: the checkpoint folder's name)."
    )
    num_tokenizer_workers: int = option(
        1, f"Tokenizer processes (at most {MAX_TOKENIZER_WORKERS})."
    )
    restart_engine: bool = option(
        False,
        "Restart a dead engine core in place (its requests fail) instead of exiting with code 1 "
        "for an orchestrator to restart the server.",
    )
    api_key: str | None = option(
        None,
        f"Require `Authorization: Bearer KEY` on every route but /health (and /metrics, see "
        f"--metrics-require-auth); ${API_KEY_ENV} is used when the flag is absent.",
        default_help=f"${API_KEY_ENV}",
    )
    metrics_require_auth: bool = option(
        False, "Require the api key on /metrics and /dashboard too."
    )
    chat_template: str | None = option(
        None, "Chat template (a file, or the Jinja text itself) instead of the checkpoint's."
    )
    tool_call_parser: str = option(
        DEFAULT_TOOL_PARSER,
        "How the model writes tool calls, parsed into `tool_calls` (and forced by a grammar for "
        "tool_choice required or a named function): hermes (<tool_call> JSON </tool_call>: "
        "Hermes, Qwen2.5, Qwen3) or llama3_json (the output is the call's JSON: Llama 3.1/3.2).",
        choices=tuple(tool_parser_names()),
    )
    reasoning_parser: str | None = option(
        None,
        "Split a thinking model's chat output into `reasoning_content` (between <think> and "
        "</think>) and `content`: deepseek_r1 (reasoning from the first token) or qwen3 "
        "(reasoning only when the output opens with <think>). Not for requests with structured "
        "outputs, whose grammar applies from the first token.",
        choices=tuple(REASONING_PARSERS),
    )
    max_request_body_bytes: int = option(
        16 * MIB, "Largest request body; larger ones get 413 before they are read."
    )
    max_prompt_bytes: int | None = option(
        None,
        "Largest prompt (UTF-8 bytes; a chat's contents together) accepted for tokenizing "
        "(default: 2 x max_model_len x the longest token's bytes; no longer prompt can fit).",
    )
    max_chat_messages: int | None = option(
        None,
        "Most messages in one chat, each content part of a message counted as one more "
        "(default: max_model_len; a chat template marks every message with a token, so no "
        "longer chat can fit).",
    )
    max_n: int = option(128, "Most sequences one request may start (n x the number of prompts).")
    max_stop: int = option(64, "Most stop strings, and most stop token ids, per request.")
    max_response_logprobs: int = option(
        1 << 22,
        "Most logprob entries (a token's or an alternative's, generated or of the prompt) one "
        "non-streamed response may hold, and a stream may leave unsent while its client does "
        "not read (an output counting as 4 entries more); past it the request is aborted with "
        "a 400 (~140 bytes an entry in the server).",
    )
    max_stop_chars: int = option(1024, "Longest stop string (characters).")
    max_waiting_requests: int | None = option(
        None,
        "Shed load: when this many sequences wait for their first token, new requests get 503 "
        "with Retry-After (default: no limit).",
    )
    retry_after_s: int = option(
        1,
        "Retry-After (seconds, at most 3600) sent with a 503 when load is shed or the model is "
        "still loading.",
    )
    trace_file: str | None = option(
        None, "Append one JSON line per finished request (token ids, timestamps, params) here."
    )
    max_recent_requests: int = option(
        100_000,
        "Finished requests remembered for POST /v1/feedback (their ids, and where their lines "
        "are in --trace-file, for GET /v1/traces/ID; about 260 bytes each); feedback on older "
        "ones gets 400.",
    )
    log_requests: bool = option(
        False,
        "Log each request on arrival (prompt, params) and a summary when it finishes.",
        negation="--disable-log-requests",
    )
    max_log_len: int | None = option(
        None, "Characters (or token ids) of a prompt shown in request logs (default: all)."
    )
    uvicorn_access_log: bool = option(
        True,
        "Log one line per HTTP request (polls of /metrics and /health are never logged).",
        negation="--disable-uvicorn-access-log",
    )
    uvicorn_log_level: str = option("info", "uvicorn's log level.", choices=LOG_LEVELS)
    root_path: str = option("", "URL prefix the app is served under behind a path-based proxy.")
    ssl_keyfile: str | None = option(None, "TLS private key file (with --ssl-certfile).")
    ssl_certfile: str | None = option(None, "TLS certificate file (with --ssl-keyfile).")
    allowed_origins: tuple[str, ...] = option(
        (),
        "CORS: origins browsers may call from, a JSON list or comma-separated (e.g. '[\"*\"]'; "
        "default: no CORS headers).",
    )
    enable_profiling: bool = option(
        False, "Allow POST /start_profile and /stop_profile (torch profiler of the engine core)."
    )
    profile_dir: str = option("tokenmill-profiles", "Where /stop_profile writes the Chrome trace.")

    def __post_init__(self) -> None:
        positive = {
            "num_tokenizer_workers": self.num_tokenizer_workers,
            "max_request_body_bytes": self.max_request_body_bytes,
            "max_prompt_bytes": self.max_prompt_bytes,
            "max_chat_messages": self.max_chat_messages,
            "max_n": self.max_n,
            "max_stop_chars": self.max_stop_chars,
            "max_response_logprobs": self.max_response_logprobs,
            "max_waiting_requests": self.max_waiting_requests,
            "max_log_len": self.max_log_len,
            "max_recent_requests": self.max_recent_requests,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be <= {MAX_N} (the bound of n), got {self.max_n}")
        if self.num_tokenizer_workers > MAX_TOKENIZER_WORKERS:
            raise ValueError(
                f"num_tokenizer_workers must be <= {MAX_TOKENIZER_WORKERS}, got "
                f"{self.num_tokenizer_workers}"
            )
        if self.max_stop < 0 or not 0 <= self.retry_after_s <= MAX_RETRY_AFTER_S:
            raise ValueError(
                f"max_stop must be >= 0 and retry_after_s in [0, {MAX_RETRY_AFTER_S}], got "
                f"{self.max_stop}, {self.retry_after_s}"
            )
        # (Found out only at /stop_profile, before.)
        if (
            self.enable_profiling
            and os.path.exists(self.profile_dir)
            and not os.path.isdir(self.profile_dir)
        ):
            raise ValueError(f"profile_dir {self.profile_dir!r} is not a directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser not in tool_parser_names():
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(tool_parser_names())}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("give both ssl_keyfile and ssl_certfile, or neither")
        for path in (self.ssl_keyfile, self.ssl_certfile):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"TLS file {path!r} does not exist")
        if self.ssl_certfile is not None:
            try:  # as uvicorn will, once the model is loading: a bad file fails here, in a line
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile
                )
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"ssl_certfile, ssl_keyfile: cannot load them: {exc}") from None
        if self.api_key == "":  # e.g. `--api-key "$KEY"` with KEY unset: every route open
            raise ValueError(
                "api_key must not be empty (it would require no key); leave the flag out to "
                f"serve without one, or to use ${API_KEY_ENV}"
            )
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must start with '/', got {self.root_path!r}")

    @property
    def resolved_api_key(self) -> str | None:
        """The api key in force: the flag's, else the environment's (empty means none)."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def model_name(self, model_path: str) -> str:
        """The name clients use: --served-model-name, else the checkpoint folder's name."""
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(model_path)) or model_path
