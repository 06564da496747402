"""Every exception class of Edge0, in one place (tests/test_layout.py keeps it so): the one a user sees as a
message, never as a traceback, and the few that callers catch by name."""


class Edge0Error(Exception):
    """Bad input or a failed precondition, worded for the user: name the file or field and what is wrong."""


class SettingError(Edge0Error):
    """A bad EngineConfig setting, or settings that do not go together. The message names each setting as {path}
    (EngineConfig's field paths: model, routing.mode, io.slots): str() says them so, say(names) as the caller knows
    them (the command line: its flags, edge0/cli/flags.py SETTING_FLAGS)."""

    def __init__(self, template: str):
        super().__init__(template)
        self.template = template

    def say(self, names: dict) -> str:
        import re

        return re.sub(r"\{([\w.]+)\}", lambda m: names.get(m[1], m[1]), self.template)

    def __str__(self) -> str:
        return self.say({})


class ContextExceeded(Edge0Error):
    """The prompt plus max_tokens does not fit the model's context."""


class NotATrace(Exception):
    """What is wrong with a file that is not a routing trace (io/routetrace.read_trace names the file)."""


class BankBusy(RuntimeError):
    """A write was attempted into a bank that a built-but-unevaluated graph may still read."""


class ApiError(Exception):
    """An error the server answers in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
    retry_after: seconds for the Retry-After header (503s)."""

    def __init__(self, status: int, message: str, code: str | None = None, type: str | None = None, *,
                 param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
