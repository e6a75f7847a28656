"""The simulator's name for `spotpipe.traces` (trace parsing is shared with trace replay)."""

from spotpipe.traces import (ADD, BUNDLED, MAX_NODES, PADDING_S, REMOVE, VICTIMS, Event, Trace,
                             TraceError, counts_to_trace, find_trace, load_trace,
                             parse_dated_series, parse_event_csv, parse_tick_json)

__all__ = ["ADD", "BUNDLED", "MAX_NODES", "PADDING_S", "REMOVE", "VICTIMS", "Event", "Trace",
           "TraceError", "counts_to_trace", "find_trace", "load_trace", "parse_dated_series",
           "parse_event_csv", "parse_tick_json"]
