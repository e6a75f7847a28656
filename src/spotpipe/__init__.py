"""spotpipe: pipeline-parallel training on spot machines that survives preemptions."""

__version__ = "0.1.0"
