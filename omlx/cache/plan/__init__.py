"""What a prompt would restore, decided before anything is read: the plan, its verdicts and the measurements they weigh."""
