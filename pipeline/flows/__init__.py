"""Flows: multi-step jobs with typed hand-offs, fan-out and fan-in, resumed from the step that failed.

`definition` declares a flow (`Flow`, its steps and their mappings), `launch` starts one (`start`) and queues the
steps a finished node lets run, `record` keeps its state in Redis (one hash tag per flow; the layout is at the top of
`pipeline/lua/flow_advance.lua`), `steps` runs a step's job in the worker; `pipeline.control.flows` shows and
cancels flows (it reads job status and cancels jobs, a layer above this package).
Steps are ordinary typed jobs: they retry, dead-letter and replay as any job does.
"""

from pipeline.flows.definition import FLOWS, Flow, FlowInvalid
from pipeline.flows.launch import FlowEmpty, FlowNotFound, get_flow, start

__all__ = ["FLOWS", "Flow", "FlowEmpty", "FlowInvalid", "FlowNotFound", "get_flow", "start"]
