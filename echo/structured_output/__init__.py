"""Structured outputs: xgrammar grammars that constrain a request's tokens.

grammar_spec builds and checks a request's Grammar (frontend and engine); compiler compiles
them off the busy loop, cached; request_grammar is one request's matcher; grammar_table holds a
set of them and does a step's work on them, in the core or in grammar_processes; manager is what
the EngineCore drives each step: compile polling, matcher advances, the step's token bitmask.
docs/ARCHITECTURE.md, Structured outputs, says how this fits two steps in flight.
"""
