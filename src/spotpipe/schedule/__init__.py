"""Pipeline schedules as data (no torch): instruction streams, checks, and a timing model."""

from spotpipe.schedule.builders import SCHEDULE_KINDS, build_schedule
from spotpipe.schedule.ir import Instr, Op, Schedule
from spotpipe.schedule.merge import global_order, merged_schedule
from spotpipe.schedule.redundancy import (REDUNDANCY_MODES, RedundancyPrediction, frc_serves,
                                          holder_of, predict, replica_of, runs_frc,
                                          with_frc)
from spotpipe.schedule.timing import (StageCosts, Timing, any_schedule_bound,
                                      closed_form_bubble, simulate)
from spotpipe.schedule.validate import ScheduleError, check

__all__ = ["REDUNDANCY_MODES", "RedundancyPrediction", "frc_serves", "holder_of", "predict",
           "replica_of", "runs_frc", "with_frc", "global_order", "merged_schedule",
           "SCHEDULE_KINDS", "Instr", "Op",
           "Schedule", "ScheduleError", "StageCosts", "Timing", "any_schedule_bound",
           "build_schedule", "check", "closed_form_bubble", "simulate"]
