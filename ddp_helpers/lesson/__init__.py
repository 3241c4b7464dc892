"""What only the notebooks use: plots, the by-hand reference, lesson mechanics, timelines, the control panel."""
