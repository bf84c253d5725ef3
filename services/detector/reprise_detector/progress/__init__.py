"""Rank progress from node reports, and the two stages that read it: hang detection and stragglers.

book: the per-rank tracks of each job and the fold of a report's statuses into them; limits: the hang limit of each
phase; stalls: the order of stalled ranks and the culprit among them; hangs: the hang judgement (HangWatch);
stragglers: the straggler judgement (StragglerWatch).
"""
