"""What a callable G holds, found without running it: its modules and the random sources it keeps.

A record taken before G runs (the state ``implicit_argmin``'s backward replays, the random state of
a snapshot) needs what G will read: a module's own attributes are read from the module, but a
function G (a lambda around modules, a bound method, a ``functools.partial``) holds its modules
and its random generators in closures, defaults, globals and objects. :func:`reached` walks them.
"""
import functools
import itertools
import types

from torch import nn

__all__ = ["reached", "modules_reached"]


#: How many items of a list, tuple or dict :func:`modules_reached` looks into.
_ITEMS = 1000


def reached(G, depth=3):
    """The objects a callable G holds, found without running it: what it is made of, ``depth`` levels down.

    G itself; a bound method's object, a ``functools.partial``'s function and arguments, a
    function's closure, defaults and the globals its code names, a callable object's attributes,
    and lists, tuples and dicts of these (their first :data:`_ITEMS` items). Modules are listed but
    not looked into (their attributes are the snapshot's business). Objects G reaches another way
    (a computed name, an object that is not callable) are not found.
    """
    found, seen = [], set()

    def visit(obj, level):
        if id(obj) in seen or level < 0:
            return
        seen.add(id(obj))
        found.append(obj)
        if isinstance(obj, nn.Module):
            return
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, level)
            visit(obj.__func__, level)
        elif isinstance(obj, functools.partial):
            for part in (obj.func, *obj.args, *obj.keywords.values()):
                visit(part, level - 1)
        elif isinstance(obj, types.FunctionType):
            cells = [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
            named = [obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__]
            for part in (*cells, *(obj.__defaults__ or ()), *named):
                visit(part, level - 1)
        elif isinstance(obj, (list, tuple, dict)):
            for part in itertools.islice(obj.values() if isinstance(obj, dict) else obj, _ITEMS):
                visit(part, level - 1)
        elif callable(obj) and not isinstance(obj, type) and hasattr(obj, "__dict__"):
            for part in vars(obj).values():
                visit(part, level - 1)

    visit(G, depth)
    return found


def modules_reached(G, depth=3):
    """The modules a callable G reaches without running it (with their submodules), for a record before G runs.

    G itself when it is a module; else the modules among what :func:`reached` finds. A module found is
    taken whole (an object holding G's module and others gives them all).
    """
    roots = [obj for obj in reached(G, depth) if isinstance(obj, nn.Module)]
    return list({id(module): module for root in roots for module in root.modules()}.values())  # once each, in order


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:  # a closure cell not assigned yet
        return False
    return True
