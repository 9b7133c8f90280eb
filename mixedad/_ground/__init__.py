"""The ground floor: what every pass of mixedad stands on, below the rules (:mod:`mixedad.op_rules`), the programs
(:mod:`mixedad._programs`) and the pass (:mod:`mixedad._frontend`).

- :mod:`~mixedad._ground.errors`: the errors and signals a pass raises (an op rule that fails, a restart, the
  whole-G fallback, a write into the caller's inputs);
- :mod:`~mixedad._ground.naming`: how messages name an op;
- :mod:`~mixedad._ground.grad_mode`: grad mode read from torch at each op;
- :mod:`~mixedad._ground.forward_pass`: the turn at PyTorch's one forward-AD level, and a forward pass's set-up;
- :mod:`~mixedad._ground.nesting`: one pass at a time per thread;
- :mod:`~mixedad._ground.watch`: what G's ops receive and read while a pass runs;
- :mod:`~mixedad._ground.random_state`: every random source G draws from, captured and replayed;
- :mod:`~mixedad._ground.state`: snapshots of G's buffers and attributes, for replays;
- :mod:`~mixedad._ground.reach`: what a function G closes over;
- :mod:`~mixedad._ground.fingerprints` and :mod:`~mixedad._ground.structure`: how a value and a module's
  structure are recorded for a later comparison;
- :mod:`~mixedad._ground.versions`: the versions of what a saved pass reads again, checked before it does;
- :mod:`~mixedad._ground.inputs` and :mod:`~mixedad._ground.writes`: the caller's inputs, which no pass writes.
"""
