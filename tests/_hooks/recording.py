"""A torch-function mode that records the functions it sees, for the hook pins."""
from mixedad._hooks.torch_function_stack import Calls as Seen

__all__ = ["Seen"]
