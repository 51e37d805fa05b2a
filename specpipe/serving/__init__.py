"""Many requests at once: the batch scheduler over the decoder, and the OpenAI-compatible server over it."""
from specpipe.serving.handle import Cancelled, DecodeRequest, RequestHandle
from specpipe.serving.scheduler import BatchScheduler, Overloaded, SchedulerLimits, SchedulerObserver

__all__ = ["BatchScheduler", "Cancelled", "DecodeRequest", "Overloaded", "RequestHandle", "SchedulerLimits",
           "SchedulerObserver"]
