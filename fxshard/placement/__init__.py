"""placement: a placement for every node, from the user's plan and the op rules.

``constraints`` turns plans (ParallelStyles, HF tp_plan strings, ``"auto"``) into fixed placements;
``problem`` defines what every node may be and what each choice costs; ``greedy`` picks node by
node, ``auto`` solves the whole graph at once.
"""
