//! The clock behind templates' `strftime_now(format)`: the local date and time, and Python's
//! `datetime.strftime` in the C locale (the codes of glibc's strftime, which Python calls), so a
//! template that states today's date states it as it does under transformers.

use std::fmt::Write;

/// A local wall-clock time, as `datetime.now()` gives it to a template (no time zone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalTime {
    pub year: i32,
    /// 1 to 12.
    pub month: u32,
    /// 1 to 31.
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

impl LocalTime {
    /// Now, in the machine's local time zone (UTC where the platform gives no local time).
    pub fn now() -> Self {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        local(secs).unwrap_or_else(|| Self::from_unix_utc(secs))
    }

    /// The UTC time `secs` seconds after 1970-01-01 00:00:00.
    pub fn from_unix_utc(secs: i64) -> Self {
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400) as u32);
        let (year, month, day) = civil_from_days(days);
        Self {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
        }
    }

    /// Days since 1970-01-01 (Howard Hinnant's days_from_civil).
    fn days(&self) -> i64 {
        let y = i64::from(self.year) - i64::from(self.month <= 2);
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let m = i64::from(self.month);
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(self.day) - 1;
        era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
    }

    /// 0 = Sunday.
    fn weekday(&self) -> u32 {
        (self.days() + 4).rem_euclid(7) as u32
    }

    /// 0-based day of the year.
    fn yday(&self) -> u32 {
        let jan1 = Self {
            month: 1,
            day: 1,
            ..*self
        };
        (self.days() - jan1.days()) as u32
    }

    /// ISO 8601 week-based year and week number.
    fn iso_week(&self) -> (i32, u32) {
        let wday = (self.weekday() + 6) % 7; // 0 = Monday
        let week = (self.yday() as i64 - wday as i64 + 10) / 7;
        let weeks_in = |year: i32| {
            let dec28 = Self {
                year,
                month: 12,
                day: 28,
                ..*self
            };
            ((dec28.yday() as i64 - ((dec28.weekday() + 6) % 7) as i64 + 10) / 7) as u32
        };
        if week < 1 {
            (self.year - 1, weeks_in(self.year - 1))
        } else if week as u32 > weeks_in(self.year) {
            (self.year + 1, 1)
        } else {
            (self.year, week as u32)
        }
    }

    /// `format` as Python's `datetime.strftime` writes it in the C locale. Unknown codes are
    /// kept as written, as glibc keeps them.
    pub fn strftime(&self, format: &str) -> String {
        let mut out = String::new();
        let mut chars = format.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let flag = match chars.peek() {
                Some(&f @ ('-' | '_' | '0' | '^')) => {
                    chars.next();
                    Some(f)
                }
                _ => None,
            };
            let Some(code) = chars.next() else {
                out.push('%');
                out.extend(flag);
                break;
            };
            match self.field(code) {
                Some(Field::Num(n, width, pad)) => {
                    let pad = match flag {
                        Some('-') => None,
                        Some('_') => Some(' '),
                        Some('0') => Some('0'),
                        _ => pad,
                    };
                    match pad {
                        None => write!(out, "{n}"),
                        Some(' ') => write!(out, "{n:>width$}"),
                        Some(_) => write!(out, "{n:0width$}"),
                    }
                    .expect("writing to a String");
                }
                Some(Field::Text(t)) if flag == Some('^') => out.push_str(&t.to_uppercase()),
                Some(Field::Text(t)) => out.push_str(&t),
                None => {
                    out.push('%');
                    out.extend(flag);
                    out.push(code);
                }
            }
        }
        out
    }

    fn field(&self, code: char) -> Option<Field> {
        use Field::{Num, Text};
        let zero = Some('0');
        let hour12 = (self.hour + 11) % 12 + 1;
        let wday = self.weekday();
        let yday = self.yday();
        Some(match code {
            'a' => Text(DAYS[wday as usize][..3].into()),
            'A' => Text(DAYS[wday as usize].into()),
            'b' | 'h' => Text(MONTHS[self.month as usize - 1][..3].into()),
            'B' => Text(MONTHS[self.month as usize - 1].into()),
            'c' => Text(self.strftime("%a %b %e %H:%M:%S %Y")),
            'C' => Num(i64::from(self.year.div_euclid(100)), 2, zero),
            'd' => Num(self.day.into(), 2, zero),
            'D' | 'x' => Text(self.strftime("%m/%d/%y")),
            'e' => Num(self.day.into(), 2, Some(' ')),
            'f' => Text("000000".into()),
            'F' => Text(self.strftime("%Y-%m-%d")),
            'g' => Num(i64::from(self.iso_week().0.rem_euclid(100)), 2, zero),
            'G' => Num(self.iso_week().0.into(), 1, None),
            'H' => Num(self.hour.into(), 2, zero),
            'I' => Num(hour12.into(), 2, zero),
            'j' => Num(i64::from(yday + 1), 3, zero),
            'k' => Num(self.hour.into(), 2, Some(' ')),
            'l' => Num(hour12.into(), 2, Some(' ')),
            'm' => Num(self.month.into(), 2, zero),
            'M' => Num(self.minute.into(), 2, zero),
            'n' => Text("\n".into()),
            'p' => Text(if self.hour < 12 { "AM" } else { "PM" }.into()),
            'P' => Text(if self.hour < 12 { "am" } else { "pm" }.into()),
            'r' => Text(self.strftime("%I:%M:%S %p")),
            'R' => Text(self.strftime("%H:%M")),
            'S' => Num(self.second.into(), 2, zero),
            't' => Text("\t".into()),
            'T' | 'X' => Text(self.strftime("%H:%M:%S")),
            'u' => Num(i64::from((wday + 6) % 7 + 1), 1, None),
            'U' => Num(i64::from((yday + 7 - wday) / 7), 2, zero),
            'V' => Num(self.iso_week().1.into(), 2, zero),
            'w' => Num(wday.into(), 1, None),
            'W' => Num(i64::from((yday + 7 - (wday + 6) % 7) / 7), 2, zero),
            'y' => Num(i64::from(self.year.rem_euclid(100)), 2, zero),
            'Y' => Num(self.year.into(), 1, None),
            // A naive datetime has no zone: Python writes nothing for these.
            'z' | 'Z' => Text(String::new()),
            '%' => Text("%".into()),
            _ => return None,
        })
    }
}

/// One strftime field: a number with its width and padding, or text.
enum Field {
    Num(i64, usize, Option<char>),
    Text(String),
}

/// (year, month, day) of the day `z` days after 1970-01-01 (Howard Hinnant's civil_from_days).
fn civil_from_days(z: i64) -> (i32, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year as i32, month, day)
}

#[cfg(unix)]
fn local(secs: i64) -> Option<LocalTime> {
    let t = secs as libc::time_t;
    // SAFETY: localtime_r only writes the `tm` it is given; a zeroed `tm` is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    ok.then(|| LocalTime {
        year: tm.tm_year + 1900,
        month: (tm.tm_mon + 1) as u32,
        day: tm.tm_mday as u32,
        hour: tm.tm_hour as u32,
        minute: tm.tm_min as u32,
        second: tm.tm_sec.min(59) as u32,
    })
}

#[cfg(not(unix))]
fn local(_secs: i64) -> Option<LocalTime> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Saturday 14 March 2026, 09:26:53.
    const PI_DAY: LocalTime = LocalTime {
        year: 2026,
        month: 3,
        day: 14,
        hour: 9,
        minute: 26,
        second: 53,
    };

    /// Expected texts are what Python 3's datetime(2026, 3, 14, 9, 26, 53).strftime gives.
    #[test]
    fn strftime_writes_what_python_writes() {
        for (format, python) in [
            ("%d %b %Y", "14 Mar 2026"),
            ("%B %d, %Y", "March 14, 2026"),
            ("%Y-%m-%d", "2026-03-14"),
            ("%A %a %j %U %W %u %w", "Saturday Sat 073 10 10 6 6"),
            ("%c|%x|%X|%D|%F|%T|%R|%r", "Sat Mar 14 09:26:53 2026|03/14/26|09:26:53|03/14/26|2026-03-14|09:26:53|09:26|09:26:53 AM"),
            ("%e|%-d|%-m|%k|%l|%I%p|%y|%C|%G-W%V|%g", "14|14|3| 9| 9|09AM|26|20|2026-W11|26"),
            ("%% %z%Z %q %", "%  %q %"),
        ] {
            assert_eq!(PI_DAY.strftime(format), python, "{format}");
        }
        let new_year = LocalTime {
            year: 2027,
            month: 1,
            day: 1,
            ..PI_DAY
        };
        // 1 January 2027 is a Friday in ISO week 53 of 2026.
        assert_eq!(
            new_year.strftime("%a %G-W%V %j %U %W"),
            "Fri 2026-W53 001 00 00"
        );
    }

    #[test]
    fn unix_seconds_become_the_utc_date() {
        assert_eq!(
            LocalTime::from_unix_utc(1_773_480_413),
            PI_DAY,
            "2026-03-14T09:26:53Z"
        );
        let epoch = LocalTime::from_unix_utc(0);
        assert_eq!(
            (epoch.year, epoch.month, epoch.day, epoch.hour),
            (1970, 1, 1, 0)
        );
        assert_eq!(
            LocalTime::from_unix_utc(951_782_400).strftime("%F %a"),
            "2000-02-29 Tue"
        );
        let now = LocalTime::now();
        assert!(now.year >= 2024 && (1..=12).contains(&now.month), "{now:?}");
    }
}
