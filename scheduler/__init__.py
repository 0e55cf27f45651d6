"""Continuous-batching scheduler: requests, queues, token budget, chunked prefill, preemption."""

from scheduler.config import SchedulerConfig, fits_context
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.structured_outputs import StructuredOutputs
from scheduler.thinking_budget import ThinkingBudget

__all__ = [
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StructuredOutputs",
    "ThinkingBudget",
    "fits_context",
]
