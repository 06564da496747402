"""The one exception type a user sees as a message, never as a traceback."""


class Edge0Error(Exception):
    """Bad input or a failed precondition, worded for the user: name the file or field and what is wrong."""
